"""Data-parallel serving: N engine replicas behind one OpenAI endpoint, prefix-aware routing.

launch.py is `pagedserve serve`'s entry (it picks the single engine, mp or Ray); frontend.py is
the endpoint; a replica pool (mp_pool.py: local processes, ray_app.py: Ray Serve deployments)
runs the replicas; routing.py decides where a request goes. Imports go one way: launch ->
frontend / ray_app / relay_worker / api_server, never back (tests/serving/test_import_graph.py).
"""
