"""What the benchmark scripts share to leave their results: a markdown table and its JSON."""

import json
import os


def write_results(out: str, stem: str, markdown: str, data: dict) -> None:
    """`<out>/<stem>.md` and `<out>/<stem>.json` (the folder made if missing), and the table on stdout."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(markdown)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(data, f, indent=1)
    print(markdown)
