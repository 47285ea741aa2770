"""A service that follows MongoDB's two-phase-commit tutorial with PyMongo.

It knows nothing of mongotx and uses the tutorial's names: transactions
in `transactions`, markers in `pendingTransactions` of `accounts`.

    python recipe_writer.py URI DB run N ACCOUNTS SEED
        N transfers of 1..50 between random accounts (comma separated),
        each: insert initial, pending, apply both, applied, pull both, done;
        prints "done" after each and "exit" at the end
    python recipe_writer.py URI DB recover
        the tutorial's recovery of every unfinished transaction: initial
        ones are moved to pending, pending ones applied (where the marker
        is absent) and committed, applied ones finished; prints
        "recovered N"
"""
import datetime
import random
import sys

from pymongo import MongoClient


def now():
    return datetime.datetime.now(datetime.timezone.utc)


def apply(db, t):
    db.accounts.update_one({"_id": t["source"], "pendingTransactions": {"$ne": t["_id"]}},
                           {"$inc": {"balance": -t["value"]},
                            "$push": {"pendingTransactions": t["_id"]}})
    db.accounts.update_one({"_id": t["destination"], "pendingTransactions": {"$ne": t["_id"]}},
                           {"$inc": {"balance": t["value"]},
                            "$push": {"pendingTransactions": t["_id"]}})
    db.transactions.update_one({"_id": t["_id"], "state": "pending"},
                               {"$set": {"state": "applied"},
                                "$currentDate": {"lastModified": True}})


def finish(db, t):
    for account in (t["source"], t["destination"]):
        db.accounts.update_one({"_id": account, "pendingTransactions": t["_id"]},
                               {"$pull": {"pendingTransactions": t["_id"]}})
    db.transactions.update_one({"_id": t["_id"], "state": "applied"},
                               {"$set": {"state": "done"},
                                "$currentDate": {"lastModified": True}})


def start(db, t):
    db.transactions.update_one({"_id": t["_id"], "state": "initial"},
                               {"$set": {"state": "pending"},
                                "$currentDate": {"lastModified": True}})


def run(db, n, accounts, seed):
    rnd = random.Random(seed)
    for _ in range(n):
        source, destination = rnd.sample(accounts, 2)
        t = {"source": source, "destination": destination, "value": rnd.randint(1, 50),
             "state": "initial", "lastModified": now()}
        t["_id"] = db.transactions.insert_one(t).inserted_id
        start(db, t)
        apply(db, t)
        finish(db, t)
        print("done", flush=True)


def recover(db):
    n = 0
    for t in db.transactions.find({"state": {"$in": ["initial", "pending", "applied"]}}):
        if t["state"] == "initial":
            start(db, t)
        if t["state"] in ("initial", "pending"):
            apply(db, t)
        finish(db, t)
        n += 1
    print("recovered", n, flush=True)


def main():
    uri, name, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    db = MongoClient(uri)[name]
    if mode == "run":
        run(db, int(sys.argv[4]), sys.argv[5].split(","), int(sys.argv[6]))
    elif mode == "recover":
        recover(db)
    else:
        sys.exit("unknown mode " + mode)
    print("exit", flush=True)


if __name__ == "__main__":
    main()
