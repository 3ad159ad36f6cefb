"""The process-wide changes `register()` makes to transformers, on one recorded list, and
their undoing (`ukhf.unregister()`; docs/hf.md, "What register() changes in transformers").

`register()` is the only place the package changes transformers for the whole process (every
other change is on one model, and `attach_context` / `unpatch_model` undo those). Each change
is recorded here when it is made, with how to restore what was there before, so that
`unregister()` leaves transformers as if the package had never been imported (a change
someone else has made over the package's since is left to them):

- ``AttentionInterface`` and ``AttentionMaskInterface``: the ``"ulysses"`` entries;
- the attention tables of the families that keep their own (guard.OWN_ATTENTION_TABLES):
  an entry that refuses the name;
- ``GenericForSequenceClassification.forward`` and ``GenericForTokenClassification.forward``
  (heads.py: the exact heads);
- ``PreTrainedModel.__call__`` (attach.py: meeting a model at its first call)."""

from typing import Callable, List, Tuple

_APPLIED: List[Tuple[str, Callable[[], None]]] = []   # (what was changed, how to restore it), in order


def record(what: str, undo: Callable[[], None]) -> None:
    """Note a process-wide change just made, and the call that restores what it replaced."""
    _APPLIED.append((what, undo))


def process_patches() -> List[str]:
    """What the package has changed in transformers for the whole process, in order."""
    return [what for what, _ in _APPLIED]


def undo_process_patches() -> None:
    """Restore every recorded change, the last first (a change made over another one
    restores it before that one is undone)."""
    while _APPLIED:
        _, undo = _APPLIED.pop()
        undo()


def set_entry(mapping: dict, key, value, what: str) -> None:
    """`mapping[key] = value`, recorded (undone: the key's former value, or no key; left
    alone if something else has replaced the package's value since)."""
    had, before = key in mapping, mapping.get(key)
    mapping[key] = value

    def undo():
        if mapping.get(key) is not value:
            return
        if had:
            mapping[key] = before
        else:
            mapping.pop(key, None)
    record(what, undo)


def set_attribute(owner, name: str, value, what: str) -> None:
    """`owner.name = value`, recorded (undone: the attribute `owner` itself held before, or
    none, so that an inherited one shows through again; left alone if something else has
    replaced the package's value since)."""
    missing = object()
    before = owner.__dict__.get(name, missing)
    setattr(owner, name, value)

    def undo():
        if owner.__dict__.get(name, missing) is not value:
            return
        if before is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, before)
    record(what, undo)
