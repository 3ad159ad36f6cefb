"""Process groups and what runs over them before any tensor is exchanged
(docs/architecture.md, "One call"):

- `groups.py`: which group a call runs on; the DP x SP mesh (SP = ring x Ulysses);
- `collectives.py`: the small collectives every part of the package shares;
- `dispatch.py`: which execution path runs a call, and the interface every path implements;
- `validate.py`: the checked metadata exchange (every rank agrees or every rank raises).
"""
