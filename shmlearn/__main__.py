from shmlearn.cli import entry

entry()
