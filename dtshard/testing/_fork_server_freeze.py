"""The last module the test harness's fork server imports (see ``harness``, "How workers start").

Importing it moves every object the server's imports made (torch, Dynamo, inductor, dtshard:
~390k objects) into the garbage collector's permanent generation (``gc.freeze``), so the workers
forked from the server never walk them again: a full collection of that heap costs ~160 ms and
leaves the CPU caches cold, and long-lived test workers run many of them. The objects stay alive
as they would anyway (they are the imported modules), and the workers' pages that hold them stay
shared with the server, since the collector no longer writes to them.
"""

import gc

gc.collect()
gc.freeze()
