"""Write this worker's environment to $RESULT_DIR/env-rank<RANK>.json."""

import json
import os

with open(os.path.join(os.environ["RESULT_DIR"], f"env-rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(dict(os.environ), f)
