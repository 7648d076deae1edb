"""The RPC layer: the store's calls as clients make them, over gRPC and the fast path.

A request's way in: a transport decodes it (gRPC: service, admin_service; the fast path:
../fastpath), calls the one transport-neutral module of calls, which applies access,
limits, ttl capping and quota once for both (calls), and encodes what it returns, with
outcomes mapped to gRPC codes in one place (status, by ../codes).

Modules, one idea each: calls (the calls both transports serve), service (the KVStore gRPC
servicer), admin_service (the Admin servicer), carriage (unary calls the fast path's CALL
carries to service's methods) and carried (the context they run in), status (a call's
exception to its gRPC code and reason), parsing (request fields to typed values), limits
(bounds on one request's work: keys, layouts, bytes), lookup_streams (Lookup over a
long-lived stream), stream_gate (how many streams run at once, a tenant's share of them),
watchdog (streams that stall).
"""
