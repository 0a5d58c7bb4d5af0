import sys

from stage1_correct.examples.stage1_milestone import main

sys.exit(main())
