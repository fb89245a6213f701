"""The `shmlearn` program: argument parsing, subcommands, and how the program ends (exit codes,
Ctrl-C, hangups, broken pipes). Each subcommand only builds a config and calls the library."""
