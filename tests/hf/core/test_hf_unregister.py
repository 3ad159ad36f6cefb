"""`ukhf.unregister()` (ulysses_kernels/hf/core/patches.py): after `register()` and
`unregister()`, transformers is as if the package had never been imported. In a fresh
Python process (this test process has imported and registered the package already): every
process-wide table entry and method `register()` changes is the very object it was before
the import, a tiny Llama's logits and its sequence- and token-classification losses are
bit-identical to those computed before the import, loading with
attn_implementation="ulysses" gets transformers' own error, `register()` again works, and an
entry someone else replaced after `register()` is left to them."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from helpers import ROOT  # noqa: E402

SCRIPT = r'''
import importlib, json, torch, transformers
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers import modeling_layers

# the families' own attention tables this transformers has (guard.OWN_ATTENTION_TABLES' list,
# read here before the package is imported: Falcon's is in 5.24 only)
TABLES = {}
for family, table in {"falcon": "FALCON_ATTENTION_CLASSES", "git": "GIT_SELF_ATTENTION_CLASSES",
                      "gpt_neo": "GPT_NEO_ATTENTION_CLASSES"}.items():
    try:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        continue
    if isinstance(getattr(module, table, None), dict):
        TABLES[family] = getattr(module, table)

def state():
    """Every object register() may change, by identity."""
    return {"attention": dict(AttentionInterface._global_mapping),
            "masks": dict(AttentionMaskInterface._global_mapping),
            **{family: dict(table) for family, table in TABLES.items()},
            "sequence": modeling_layers.GenericForSequenceClassification.__dict__.get("forward"),
            "token": modeling_layers.GenericForTokenClassification.__dict__.get("forward"),
            "call": PreTrainedModel.__dict__.get("__call__")}

def same(a, b):
    return all((a[k] == b[k]) if isinstance(a[k], dict) else (a[k] is b[k]) for k in a) and a.keys() == b.keys()

def outputs():
    """A tiny Llama's logits and its two classification heads' losses (fixed seeds)."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, num_labels=3)
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    found = []
    for cls, labels in ((transformers.AutoModelForCausalLM, ids),
                        (transformers.AutoModelForSequenceClassification, torch.tensor([0, 2])),
                        (transformers.AutoModelForTokenClassification, ids % 3)):
        torch.manual_seed(0)
        model = cls.from_config(config, attn_implementation="eager")
        out = model(input_ids=ids, labels=labels)
        found += [out.loss.detach().clone(), out.logits.detach().clone()]
    return found

before, computed = state(), outputs()
from ulysses_kernels import hf as ukhf
ukhf.register()
changed = [k for k, v in state().items() if not (v == before[k] if isinstance(v, dict) else v is before[k])]
patches = ukhf.process_patches()
ukhf.register()   # idempotent: nothing recorded twice
twice = len(ukhf.process_patches()) == len(patches)
ukhf.unregister()
restored = same(state(), before) and ukhf.process_patches() == []
bitwise = all(torch.equal(a, b) for a, b in zip(outputs(), computed))
try:
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4),
        attn_implementation="ulysses")
    unknown = "loaded"
except Exception as exc:
    unknown = f"{type(exc).__name__}: {exc}"
ukhf.register()
again = "ulysses" in AttentionInterface._global_mapping and len(ukhf.process_patches()) == len(patches)
# a change made over the package's after register() is not undone by unregister()
ukhf.register()
theirs = lambda *args, **kwargs: None
AttentionInterface._global_mapping["ulysses"] = theirs
ukhf.unregister()
kept_theirs = AttentionInterface._global_mapping.get("ulysses") is theirs
del AttentionInterface._global_mapping["ulysses"]
from ulysses_kernels.hf.core.guard import OWN_ATTENTION_TABLES
print(json.dumps(dict(changed=sorted(changed), patches=patches, twice=twice, restored=restored, bitwise=bitwise,
                      unknown=unknown, again=again, kept_theirs=kept_theirs, tables=sorted(TABLES),
                      guarded=sorted(OWN_ATTENTION_TABLES))))
'''


def test_unregister_leaves_transformers_as_before_the_import():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(found, indent=1))
    # register() changed every object, each recorded once (transformers 5.25: seven; 5.24 has
    # Falcon's table too), and the test watched every table the guard patches
    assert set(found["tables"]) <= set(found["guarded"]) and {"git", "gpt_neo"} <= set(found["tables"]), found
    expected = sorted(["attention", "call", "masks", "sequence", "token", *found["tables"]])
    assert found["changed"] == expected, found
    assert len(found["patches"]) == len(expected) and found["twice"], found["patches"]
    assert found["restored"] and found["bitwise"], found
    assert found["unknown"].startswith("ValueError") and "ulysses" in found["unknown"], found["unknown"]
    assert found["again"] and found["kept_theirs"]
