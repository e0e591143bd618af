"""How a benchmark rank that used torch.distributed's Gloo ends: at once, after its output.

After `destroy_process_group()` Gloo's worker thread may still be destroying the last work object
(a barrier's), which holds a Python reference: if the interpreter is finalizing by then, taking
the GIL ends that thread, and libstdc++ aborts the process ("terminate called without an active
exception", or a segfault), although the rank finished its job and printed its result. Seen here
about once in twenty W=2 runs on a loaded machine (pytorch/pytorch#179291 describes the same
race). Skipping finalization leaves nothing for that thread to race with.
"""

import os
import sys
from typing import NoReturn


def exit_now(code: int = 0) -> NoReturn:
    """Flush what the rank printed and end the process without interpreter finalization."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
