import sys

from mlx_relay.cli import main

sys.exit(main())
