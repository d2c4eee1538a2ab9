"""The ``astraflow`` command line. Each sub-command lives in its own module here."""
