"""One module per ``xgrad`` subcommand (see ``xgrad.cli``)."""
