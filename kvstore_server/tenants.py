"""Tenant namespaces: the store-side id of a tenant's layout.

Layouts belong to a tenant (docs/architecture.md, "Words"). The client names a layout by its own
`layout_id` (a hash of the PageLayout); the store keys it by

    scoped_layout_id(tenant, layout_id)

so two tenants that register the same PageLayout get disjoint namespaces, and a tenant
that names a layout it did not register finds nothing ("unknown layout"), which tells it
nothing about whether another tenant has one. The disk tier keys pages by the scoped id
too, so a tenant's pages come back to it, and only to it, after a restart.

The built-in tenant of a server without an auth file keeps the client's ids unchanged,
so turning auth off changes nothing on the wire or on disk; a tenant named "default" in
an auth file inherits those pages.
"""

from __future__ import annotations

import hashlib

__all__ = ["DEFAULT_TENANT", "scoped_layout_id"]

DEFAULT_TENANT = "default"

_PERSON = b"kvstore.tenant1"     # BLAKE2 personalisation: ids of this scheme only


def scoped_layout_id(tenant: str, layout_id: bytes) -> bytes:
    """The store's 16-byte id for `tenant`'s layout `layout_id`.

    BLAKE2b and not xxh3 (which makes the client's ids): a tenant chooses its layouts
    freely, and must not be able to search for one whose scoped id equals another
    tenant's, which a non-cryptographic hash would not rule out.
    """
    if tenant == DEFAULT_TENANT:
        return layout_id
    name = tenant.encode()
    return hashlib.blake2b(len(name).to_bytes(2, "little") + name + layout_id,
                           digest_size=16, person=_PERSON).digest()
