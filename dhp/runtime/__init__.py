"""Ray runtime: actor groups, worker contracts, the cross-group hand-off and the driver step."""
