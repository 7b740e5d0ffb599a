"""AWS sites as EC2 behaves: a cache volume attached to one instance at a time, detached only
from a stopped instance, and public addresses that exist in any subnet and survive stop/start."""

import re

import pytest

from denv_iac.components.preview import _address as mock_address
from tests.components import stacks
from tests.components.harness import cluster_outputs, run_program

INSTANCE = "aws:ec2/instance:Instance"
EIP = "aws:ec2/eip:Eip"
ATTACHMENT = "aws:ec2/volumeAttachment:VolumeAttachment"
PREVIEW = pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])


@PREVIEW
def test_the_cache_attachment_is_replaced_delete_first_and_detached_from_a_stopped_instance(
    preview: bool,
) -> None:
    run = run_program(lambda: cluster_outputs(stacks.multicloud()), preview=preview)
    attachments = run.of_type(ATTACHMENT)
    assert attachments, "the AWS site attaches a cache volume per node"
    for attachment in attachments:
        # create-before-delete fails with VolumeInUse (pulumi/pulumi-aws#2769)
        assert attachment.delete_before_replace, attachment.name
        assert attachment.inputs["stopInstanceBeforeDetaching"] is True, attachment.name


def test_every_instance_has_an_elastic_ip_and_its_address_is_what_everyone_uses() -> None:
    run = run_program(lambda: cluster_outputs(stacks.multicloud()), preview=False)
    instances = {r.urn: r for r in run.of_type(INSTANCE)}
    eips = run.of_type(EIP)
    assert sorted(e.name for e in eips) == sorted(f"{i.name}-eip" for i in instances.values())
    for eip in eips:
        assert eip.inputs["domain"] == "vpc"
        assert eip.inputs["instance"] == f"{eip.name.removesuffix('-eip')}-id"
    # the mocks give an Elastic IP and its instance different addresses: the EIP's must win,
    # where the deploy logs in and where the balancer hosts dial the nodes' overlay interface
    eip_addresses = {mock_address(e.name) for e in eips}
    instance_addresses = {mock_address(i.name) for i in instances.values()}
    deploys = run.of_type("pulumi-python:dynamic/denv:NodeDeployment")
    logins = {d.inputs["host"] for d in deploys if d.name.startswith("prod-aws-use1-node-")}
    hub = next(d for d in deploys if d.name == "prod-balancer-hetzner-fsn-setup-deploy")
    dialled = set(re.findall(r"Endpoint = ([0-9.]+):", hub.inputs["overlay_config"]))
    for used in (logins, dialled & (eip_addresses | instance_addresses)):
        assert used and used <= eip_addresses and not used & instance_addresses
    assert set(run.outputs["balancer_addresses"]) & eip_addresses  # the AWS balancer host too
