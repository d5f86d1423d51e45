"""`python -m megamoe_convert ...` = `megamoe-convert ...`."""
from .cli.main import main

if __name__ == "__main__":  # pragma: no cover
    main()
