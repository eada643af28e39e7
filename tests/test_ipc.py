"""Socket directories (engine/ipc.py): a long $TMPDIR must not make the engine's ipc sockets unbindable."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
import zmq

from mmserve.engine.ipc import LONGEST_SOCKET_NAME, MAX_SOCKET_PATH, socket_directory


@pytest.mark.parametrize("depth", [0, 6])
def test_the_longest_socket_name_binds_in_a_socket_directory_whatever_the_tmpdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, depth: int
) -> None:
    """Under a short temporary directory the sockets stay there; under one too long for sockaddr_un
    (the path of a socket in it would overflow 107 bytes), they go under /tmp. Either way the directory is
    private and a socket of the longest name the engine uses binds and carries a message."""
    # depth 0: a short directory of /tmp's (tmp_path itself may already be long on some machines)
    base = tmp_path.joinpath(*["a-rather-long-directory-name"] * depth) if depth else Path(tempfile.mkdtemp(dir="/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    directory = socket_directory("mmserve-core-")
    try:
        assert (Path(directory).parent == base) == (depth == 0)
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        address = f"ipc://{directory}/output-999999-0123abcd"
        assert len(address) - len("ipc://") == len(directory) + LONGEST_SOCKET_NAME <= MAX_SOCKET_PATH
        context = zmq.Context()
        try:
            pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
            pull.bind(address)
            push.connect(address)
            push.send(b"hello")
            assert pull.poll(5000) and pull.recv() == b"hello"
            pull.close(0)
            push.close(0)
        finally:
            context.term()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        if not depth:
            shutil.rmtree(base, ignore_errors=True)
