"""The arguments of every ``compat`` command, one module per command (``app.arguments.<name>.add_arguments``),
apart from the command's code (``app.commands.<name>.run``): building a command's parser, and so its ``--help``,
imports argparse only, never torch, Ray or MLflow."""
