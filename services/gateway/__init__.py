"""The public gateway: authentication, tenant, validation, deadline; relays to the router."""
