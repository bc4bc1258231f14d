"""python -m augury.train --target DIR --out DIR [...] (same as `augury train-draft`)."""
import sys

from augury.train import train_main

sys.exit(train_main())
