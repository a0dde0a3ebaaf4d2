"""Print the README's Nth ```bash block (1: install and run the main job, 2: install and pass the
tests), so that CI runs the README's commands as the README writes them."""

import re
import sys
from pathlib import Path

blocks = re.findall(r"^```bash\n(.*?)^```", Path("README.md").read_text(), re.M | re.S)
print(blocks[int(sys.argv[1]) - 1].strip())
