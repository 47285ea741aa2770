"""The tutorial's recipe, by a writer that knows nothing of mongotx.

Finishes the pending transaction TID (in the `transactions` collection of
DB) the way MongoDB's two-phase-commit tutorial does with PyMongo: commit
it (pending -> applied), pull its marker from each account of its ops
(`pendingTransactions`), then move it to done.  It knows no other field
mongotx keeps (txHeld, txVersion, txPending).

    python recipe.py URI DB TID ACCOUNT...
"""
import sys

from pymongo import MongoClient


def main():
    uri, name, tid, accounts = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    db = MongoClient(uri)[name]
    if db.transactions.update_one({"_id": tid, "state": "pending"},
                                  {"$set": {"state": "applied"},
                                   "$currentDate": {"lastModified": True}}).matched_count != 1:
        sys.exit("not pending: " + tid)
    for account in accounts:
        db.accounts.update_one({"_id": account, "pendingTransactions": tid},
                               {"$pull": {"pendingTransactions": tid}})
    db.transactions.update_one({"_id": tid, "state": "applied"},
                               {"$set": {"state": "done"},
                                "$currentDate": {"lastModified": True}})


if __name__ == "__main__":
    main()
