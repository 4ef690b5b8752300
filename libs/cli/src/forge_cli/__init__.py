"""The ``forge`` command line: the local platform's life cycle and the home of service subcommands."""
