"""``python -m hf_memo``: the ``hf-memo`` command line."""

import sys

from hf_memo.integrations.cli import main

if __name__ == "__main__":
    sys.exit(main())
