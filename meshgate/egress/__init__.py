"""Where traffic leaves this host, and under which policy.

- `dialer`: resolve and connect from this host (happy eyeballs), UDP egress.
- `rules`: the exit rules where traffic leaves the mesh (own virtual IP,
  mapped proxy CIDRs, exit grant, `[exit]` policy).
- `connect`: the policy-checked connect the mesh is handed for the streams
  that end on this node.
- `mesh_dialer`: the portal's dialer on a mesh node: which node a
  destination leaves from.
"""
