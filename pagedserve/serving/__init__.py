"""Data-parallel serving: N engine replicas behind one OpenAI endpoint, prefix-aware routing.

frontend.py is the endpoint; a replica pool (mp_pool.py: local processes, ray_app.py: Ray
Serve deployments) runs the replicas; routing.py decides where a request goes.
"""
