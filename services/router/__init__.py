"""The router: tokenize once, response cache, tier and replica choice, retries, cancel propagation."""
