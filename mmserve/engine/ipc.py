"""Private directories for ZeroMQ `ipc://` sockets (the engine core's, a front end's, the tensor-parallel
ranks' plan sockets). A socket's path must fit `sockaddr_un.sun_path` (107 bytes and a NUL on Linux), which a
long $TMPDIR (a CI workspace, a cluster scratch path) can overflow: binding then fails with "ipc path is longer
than 107 characters". Where it would, the directory goes under /tmp instead; either way it is made 0700, so
only this user's processes can connect."""

from __future__ import annotations

import os
import tempfile

# sockaddr_un.sun_path: 108 bytes on Linux, one of them the terminating NUL.
MAX_SOCKET_PATH = 107
# The longest socket name put in such a directory, with its separator: "/output-<client index>-<8 hex digits>"
# for a front end's output socket (client indices stay far below 10^6); the ranks' names ("plan-3", "reply") and
# the core's ("input") are shorter.
LONGEST_SOCKET_NAME = len("/output-999999-0123abcd")
_RANDOM_SUFFIX = 8  # tempfile.mkdtemp's


def socket_directory(prefix: str) -> str:
    """A new directory (0700) for ipc sockets named up to LONGEST_SOCKET_NAME: under the temporary directory
    where every such path fits MAX_SOCKET_PATH, else under /tmp. The caller removes it."""
    base = tempfile.gettempdir()
    longest = len(os.fsencode(base)) + 1 + len(prefix) + _RANDOM_SUFFIX + LONGEST_SOCKET_NAME
    if longest > MAX_SOCKET_PATH and os.path.isdir("/tmp"):
        base = "/tmp"
    return tempfile.mkdtemp(prefix=prefix, dir=base)
