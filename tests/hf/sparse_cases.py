"""What the sparse-attention tests (tests/hf/families/test_hf_dsa.py, test_hf_qsa.py,
test_hf_compressed.py, test_hf_block_sparse.py) share: selections as masks, a package function
recorded while it runs, and one generation against the one-process reference. Spawned ranks
import this module by name."""

import contextlib

import torch
from helpers import rel_err

PROMPT, NEW_TOKENS = 13, 6


def as_mask(indices: torch.Tensor, width: int) -> torch.Tensor:
    """`[..., width]` bool: the positions `indices` `[..., k]` names (negative: an empty slot)."""
    kept = torch.zeros(*indices.shape[:-1], width + 1, dtype=torch.bool, device=indices.device)
    return kept.scatter_(-1, torch.where(indices >= 0, indices, width).long(), True)[..., :width]


@contextlib.contextmanager
def recorded(module, name: str, keep):
    """Within: `module.name` runs as before, and `keep(args, result)` appends what to record of
    each call to the yielded list; the function is restored after."""
    original, calls = getattr(module, name), []

    def record(*args):
        result = original(*args)
        calls.append(keep(args, result))
        return result

    setattr(module, name, record)
    try:
        yield calls
    finally:
        setattr(module, name, original)


def prompt_ids() -> torch.Tensor:
    return torch.randint(3, 96, (2, PROMPT), generator=torch.Generator().manual_seed(3))


def generation_outcome(reference, model, groups, *, want=None, extra_chunks=()):
    """Greedy `ukhf.generate` of `model` (batch 2, `prompt_ids()`) against `reference`'s
    `model.generate` (or `want`, the reference's tokens found otherwise): the tokens equal with
    the prompt prefilled whole and in chunks of 4 (and of each of `extra_chunks`, 2 new tokens),
    the prefill logits' error in chunks of 5 against one process, and the cache it left."""
    from ulysses_kernels import hf as ukhf

    ids = prompt_ids()
    with torch.no_grad():
        if want is None:
            want = reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        want_logits = reference(ids, use_cache=False).logits[:, -1]
        out = dict(new=want[:, PROMPT:].tolist())
        for chunk in (None, 4):
            got = ukhf.generate(model, ids, groups, prefill_chunk_size=chunk, max_new_tokens=NEW_TOKENS,
                                do_sample=False)
            out[f"chunks of {chunk}"] = torch.equal(got, want)
        for chunk in extra_chunks:
            got = ukhf.generate(model, ids, groups, prefill_chunk_size=chunk, max_new_tokens=2, do_sample=False)
            out[f"chunks of {chunk}"] = torch.equal(got, want[:, :PROMPT + 2])
        logits, cache = ukhf.prefill(model, ids, groups, chunk_size=5)
    out["logits"] = rel_err(logits, want_logits)
    return out, cache


def check_generation(per_rank, tolerance, where=""):
    """Every rank's `generation_outcome`s (a dict, or a dict of them): every token equal, the
    prefill logits within `tolerance`."""
    for rank, out in enumerate(per_rank):
        for key, value in out.items():
            if key.startswith("chunks of"):
                assert value, (where, rank, key, out)
        assert out["logits"] < tolerance, (where, rank, out)
