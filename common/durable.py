"""Files that survive a crash or power cut whole: the checkpoints' meta files and `latest`, eval.json,
metrics.jsonl's rewrite at a resume.

  fsync_dir(path)                 make the entries of a directory (files created or renamed) durable
  write_text_durably(path, text)  path holds the old text or the whole new one, never a part
  append_durably(path, text)      appended and on disk before it returns
"""
from __future__ import annotations

import os


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_durably(path: str, text: str) -> None:
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def append_durably(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
