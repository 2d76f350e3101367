"""Creating Kafka ACLs with aiokafka's admin client (part of the Kafka adapter, like kafka.py).

aiokafka's `AIOKafkaAdminClient` has no ACL methods, but its protocol module has CreateAcls;
one request per rule goes to any broker (the controller applies them). Errors in the response
are raised as `BusError` naming the rule; a rule that exists already is not an error (Kafka
answers it with success).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.protocol.admin import CreateAclsRequest

from miles.acls import Acl
from miles.errors import AuthorizationError, BusError

RESOURCE_TYPES = {"topic": 2, "group": 3}
PATTERN_LITERAL, PATTERN_PREFIXED = 3, 4
OPERATIONS = {"Read": 3, "Write": 4, "Create": 5, "Describe": 8, "DescribeConfigs": 10}
PERMISSIONS = {"Deny": 2, "Allow": 3}
ANY_HOST = "*"
CLUSTER_AUTHORIZATION_FAILED = 31


async def create_acls(admin: AIOKafkaAdminClient, acls: Iterable[Acl]) -> int:
    """Create every rule of `acls`; returns how many were sent."""
    acls = list(acls)
    responses = await asyncio.gather(*(admin._send_request(_request(acl))  # no public API
                                       for acl in acls))
    failures = []
    for acl, response in zip(acls, responses):
        for code, message in response.creation_responses:
            if code == CLUSTER_AUTHORIZATION_FAILED:
                raise AuthorizationError("creating ACLs needs Alter on the cluster (a super "
                                         "user such as the secured broker's admin)")
            if code != 0:
                failures.append(f"{acl}: error {code} {message}")
    if failures:
        raise BusError("creating ACLs failed: " + "; ".join(failures))
    return len(acls)


def _request(acl: Acl) -> CreateAclsRequest:
    return CreateAclsRequest(
        resource_type=RESOURCE_TYPES[acl.resource], resource_name=acl.name,
        resource_pattern_type_filter=PATTERN_PREFIXED if acl.prefixed else PATTERN_LITERAL,
        principal=acl.principal, host=ANY_HOST, operation=OPERATIONS[acl.operation],
        permission_type=PERMISSIONS[acl.permission])
