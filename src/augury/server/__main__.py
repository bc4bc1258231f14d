"""`python -m augury.server [flags]`: the same as `augury serve [flags]`."""
import sys

from augury.server import serve_main

if __name__ == "__main__":
    sys.exit(serve_main())
