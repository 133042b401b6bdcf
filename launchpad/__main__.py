"""``python -m launchpad ...``: the same as the ``launchpad`` console script."""

from launchpad.cli import main

main(prog_name="launchpad")
