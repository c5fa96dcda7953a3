"""What every bench script does with its result: print it as JSON, and write it to --out when given."""

import json
from pathlib import Path


def emit(res: dict, out: str | None) -> None:
    text = json.dumps(res, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
