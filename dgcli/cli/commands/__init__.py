"""The dg commands, one thin file each (parse, call the library, render). What they share lives beside
them in dgcli/cli/ (_options, _models, _prompt, _display, _terminal, _output, _errors); `dgcli.cli`
assembles them into the Typer app."""
