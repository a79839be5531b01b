"""The `omnistage` command, the top of the house: it composes omni_common and services (which
never import it) into processes. `main` builds the parser and serves; the subcommands live by
whom they call: a coordinator (client_commands), one replica (replica_commands), nothing
(tool_commands), the local cluster (cluster_command)."""
