"""Observe mode: the agent beside another program that writes the node's nat rules, saying whether those rules
enforce the intent, and never writing: the observer, and the provider's inputs it reads through the API."""
