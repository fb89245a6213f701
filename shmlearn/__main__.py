try:
    from shmlearn.cli.main import entry
except KeyboardInterrupt:  # Ctrl-C before the program's own handler is in place (exits.py): its line, 130
    import sys
    print("shmlearn: interrupted (Ctrl-C)", file=sys.stderr)
    sys.exit(130)

entry()
