"""Where a sweep directory lives: a local path, or a shared storage URI that any ``pyarrow.fs``
filesystem serves (``s3://bucket/sweeps/x``, ``gs://...``, ``hdfs://...``, ``file:///...``).

The sweep runner reads and writes its directory only through this: resume (which runs are complete),
sweep.parquet and sweep.json, and the files of runs that were computed elsewhere (a Ray task returns
them as bytes, or writes them here itself when ``--out`` is a URI every node can reach).
"""
from __future__ import annotations

import json
import os
import posixpath

from kvbench.errors import InputError
from kvbench.jsonio import dumps


def is_uri(location: str) -> bool:
    return "://" in location


class SweepStore:
    def __init__(self, location: str):
        self.location = location
        if is_uri(location):
            import pyarrow as pa
            import pyarrow.fs as pafs

            try:
                self.fs, self.root = pafs.FileSystem.from_uri(location)
            except (pa.ArrowException, ValueError, OSError) as e:
                raise InputError(f"not a storage URI pyarrow can open ({str(e).splitlines()[0][:100]})",
                                 file=location, field="--out") from None
            self.local = None
        else:
            self.fs, self.root, self.local = None, os.path.abspath(location), os.path.abspath(location)

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts) if self.fs is not None else os.path.join(self.root, *parts)

    def makedirs(self) -> None:
        try:
            if self.fs is not None:
                self.fs.create_dir(self.root, recursive=True)
            else:
                os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise InputError(f"cannot create the sweep directory ({e.strerror or e})", file=self.location,
                             field="--out") from None

    def read_bytes(self, *parts: str) -> bytes | None:
        try:
            if self.fs is not None:
                with self.fs.open_input_stream(self.path(*parts)) as fh:
                    return fh.read()
            with open(self.path(*parts), "rb") as fh:
                return fh.read()
        except (OSError, FileNotFoundError):
            return None

    def read_json(self, *parts: str) -> dict | None:
        raw = self.read_bytes(*parts)
        try:
            obj = None if raw is None else json.loads(raw)
        except (ValueError, RecursionError):
            return None
        return obj if isinstance(obj, dict) else None

    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Write a file whole: readers never see half of it (local: a temporary file renamed)."""
        path = self.path(*parts)
        if self.fs is not None:
            self.fs.create_dir(posixpath.dirname(path), recursive=True)
            with self.fs.open_output_stream(path) as fh:
                fh.write(data)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)

    def write_json(self, obj: dict, *parts: str) -> None:
        self.write_bytes((dumps(obj, indent=2) + "\n").encode("utf-8"), *parts)

    def exists(self, *parts: str) -> bool:
        if self.fs is not None:
            import pyarrow.fs as pafs

            return self.fs.get_file_info(self.path(*parts)).type != pafs.FileType.NotFound
        return os.path.exists(self.path(*parts))

    def remove_run(self, name: str) -> None:
        if self.fs is not None:
            self.fs.delete_dir(self.path(name))
        else:
            import shutil

            shutil.rmtree(self.path(name))

    def put_run(self, name: str, files: dict[str, bytes]) -> None:
        """A run computed elsewhere: its files, summary.json last (it marks the run complete)."""
        for f in sorted(files, key=lambda f: f == "summary.json"):
            self.write_bytes(files[f], name, f)
