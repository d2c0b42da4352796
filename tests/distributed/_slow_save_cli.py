"""``eqjax.cli.main(argv)`` with process 0's checkpoint save held open (test helper, not a user tool).

Process 0 prints ``saving`` once every process has written its arrays into the temporary directory
and then sleeps before the manifest is written, so that a test can kill the whole job mid-save. Run
with ``EQJAX_SUPERVISED=1`` (the supervisor would re-execute the CLI without this patch).
"""

import sys
import time

import eqjax.io.orbax as orbax_io
from eqjax.cli.main import main

_real = orbax_io._file_table


def _slow(root):
    print("saving", flush=True)
    time.sleep(600)
    return _real(root)


orbax_io._file_table = _slow
sys.exit(main(sys.argv[1:]))
