"""The forkserver's first import (forkserver.py): from here on it dies with its owner. Without it
a forkserver whose owner was killed while it imported torch went on importing, with nobody to
serve, for seconds (20-30 s under load: an orphan of the fault campaign's kill-launcher cases);
after its imports it leaves by itself (multiprocessing's alive pipe). The variable is removed
here, so the forks it serves do not see it."""
import os

from shmlearn.launch.parent import OWNER_ENV, die_with_parent

_owner = os.environ.pop(OWNER_ENV, None)
if _owner:
    die_with_parent(int(_owner))
