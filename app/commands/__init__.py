"""One module per ``compat`` sub-command: each reads the parsed arguments (``app.arguments``) and calls
``pipelines`` and ``cluster``; the heavy ones import torch only when they compute."""
