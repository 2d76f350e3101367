"""Weight versions: the trainer writes them to a store and announces them; producers verify them.

Weights never travel through Kafka (claim check): the `WeightVersion` record on the control topic
carries the URI of the weights file, its size and its sha256.
"""
