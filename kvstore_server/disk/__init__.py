"""The disk tier: pages evicted from DRAM, written behind to slot files, read back on a miss.

A page's life here is drawn in tier.py: offered (copied into the staging ring, offer never
waits) -> written by the writer thread into a slot of a slot file -> READY, read back on a
DRAM miss -> evicted for room or by an admin, or deleted (durably: a deleted key never
comes back after a kill). At start the index is rebuilt from the slots' headers.

Modules, one idea each: tier (the DiskTier shell: its lock, the writer thread and the Tier
interface), staging (the write-behind ring of staging memory), slots (DiskSlots: slot ids,
their index and eviction), slotfile (the bytes on disk: a file per slot size, a header per
slot), slot_io (reads and writes batched into runs of adjacent slots; the folder lock),
stats (the tier's counters and its kvstore_disk_* metrics).
"""
