import sys

from shmlearn.cli import main

sys.exit(main())
