"""The agent's API side: the config it follows through the API, what it reports (Events, its node's status), and
the wiring that starts them beside the loop."""
