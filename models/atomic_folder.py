"""Writing a model folder so that it appears whole or not at all (a crash mid-write
never leaves a half-written folder a later run would load)."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def write_folder_atomically(out_dir: str | os.PathLike, write: Callable[[Path], None], *,
                            overwrite: bool = False) -> Path:
    """``write(tmp)`` fills a temporary sibling of ``out_dir`` (same filesystem), which
    is then renamed into place. An existing non-empty ``out_dir`` is a FileExistsError
    unless ``overwrite`` (checked before writing and again before the rename, in case
    someone else filled it meanwhile). Returns the absolute ``out_dir``."""
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} already exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the result should look like a normal folder
        if out_dir.exists() and any(out_dir.iterdir()):
            if not overwrite:
                raise FileExistsError(f"{out_dir} already exists and is not empty")
            # Move the old folder aside first: rename cannot replace a non-empty dir.
            trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.rename(out_dir, trash / "old")
            os.rename(tmp, out_dir)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)  # on POSIX this also replaces an empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
