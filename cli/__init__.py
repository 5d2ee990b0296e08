"""sdfarm.cli: the `sdfarm` command line (every command takes `--json`) and `./dev demo`."""
