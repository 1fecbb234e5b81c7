"""The fleet: does every node enforce the ConfigMap's current content? The view `ipmasq status` prints, the tally
the summary Events tell, and whether the nodes' status objects can be believed (the node-trust policy). The agent
that writes the summary is ipmasq.agent.api.summary."""
