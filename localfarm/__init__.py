"""sdfarm.localfarm: a whole farm on one machine (a private redis-server, a scheduler, one
worker per device), as `sdfarm up`, `./dev demo` and the tests run it."""
