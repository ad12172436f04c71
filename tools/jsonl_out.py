"""The probes' one output convention: a record printed as one JSON line and, when OUT is set (the device tool's
folder that comes back), appended to $OUT/<name>. A tool imports it as its neighbour (``from jsonl_out import
emit``): a script's own folder is first on sys.path, whatever tree it imports kldiv_inline from."""
import json
import os


def emit(record: dict, name: str) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], name), "a") as f:
            f.write(line + "\n")
