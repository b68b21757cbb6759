"""The dg commands, one thin file each (parse, call the library, render); `_shared` holds what they share.
`dgcli.cli` assembles them into the Typer app."""
