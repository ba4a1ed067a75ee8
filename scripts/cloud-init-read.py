#!/usr/bin/python3
# What cloud-init's own code (Debian's cloud-init package, as a stock cloud image runs it)
# reads from a config drive in OpenStack's config-2 layout: the tests give it the files
# Shepherd writes, and check what it makes of them.
#
# cloud-init-read.py DIR MAC=NAME...: reads DIR/openstack/latest/ with cloud-init's
# ConfigDriveReader (with the keys as its ConfigDrive data source takes them from a v2
# drive), converts its network_data.json to cloud-init's network config as the
# ConfigDrive data source does, on a machine whose NICs are the MAC=NAME pairs given, and
# prints one JSON object: instance_id, hostname, public_keys, user_data, vendor_data (the
# cloud-config cloud-init takes from vendor_data.json), network (or network_error: what
# cloud-init refused).
import json
import sys

from cloudinit import sources
from cloudinit.sources.helpers import openstack

source, nics = sys.argv[1], dict(pair.split("=", 1) for pair in sys.argv[2:])
read = openstack.ConfigDriveReader(source).read_v2()
metadata = read["metadata"]
user_data = read.get("userdata")
out = {
    "instance_id": metadata.get("instance-id"),
    "hostname": metadata.get("local-hostname"),
    "public_keys": sources.normalize_pubkey_data(metadata.get("public_keys")),
    "user_data": user_data.decode() if isinstance(user_data, bytes) else user_data,
    "vendor_data": sources.convert_vendordata(read.get("vendordata")),
}
try:
    out["network"] = openstack.convert_net_json(read.get("networkdata"), known_macs=nics)
except ValueError as error:
    out["network_error"] = str(error)
print(json.dumps(out))
