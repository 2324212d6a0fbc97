"""The command line, one module per group of commands; `app.main` is the entry point."""
